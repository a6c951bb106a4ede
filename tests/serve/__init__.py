"""Server tests. A package, so that its conftest is `serve.conftest` and never shadows
the `conftest` module that other test files import from (tests/conftest.py)."""
