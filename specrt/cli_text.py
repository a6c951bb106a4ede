"""How the command line speaks: defaults in `--help`, and the Python API's errors in the
words of the command that hit them (`temperature=0` -> `--temperature 0`)."""
from __future__ import annotations

import argparse
import re


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, except where it is None or False (nothing given,
    a switch off) or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if "default" in text or d is None or d is False or d is argparse.SUPPRESS or d in ([], ""):
            return text
        return super()._get_help_string(action)


def show_build_defaults(b: argparse.ArgumentParser) -> None:
    """The build's flags default to None ("the preset's or the config's value"): show BuildConfig's
    defaults in their help (a preset changes the draft and the output folder only)."""
    from dataclasses import MISSING, fields

    from specrt.builder.config import BuildConfig    # a dataclass: no torch
    defaults = {f.name: f.default for f in fields(BuildConfig) if f.default is not MISSING}
    for action in b._actions:
        value = defaults.get(action.dest)
        if value is not None and action.help and "default" not in action.help and not isinstance(value, bool):
            action.help += f" (default: {value})"


_QUOTES = "'\""
# the generator's method arguments, as `specrt generate` spells them (longest first)
_METHOD_WORDS = (
    ("methods=('plain',) or ('plain', 'lookup') (`specrt generate --plain`, or --lookup 2 for prompt lookup)",
     "--plain (or --lookup 2 for prompt lookup)"),
    ("method='plain' (`specrt generate --plain`)", "--plain"),
    ("method='speculative' / 'plain' to sample", "leave --lookup out (or use --plain) to sample"),
    ("method='lookup'", "--lookup"),
    ("method='plain'", "--plain"),
)


def in_flag_words(message: str, parser: argparse.ArgumentParser) -> str:
    """An error of the Python API in the words of the command that hit it: `temperature=0` ->
    `--temperature 0`, `method='lookup'` -> `--lookup`, for the options this command has (the API's
    own messages keep the argument names its callers type)."""
    for api, flag in _METHOD_WORDS:
        message = message.replace(api, flag)
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest in (None, argparse.SUPPRESS):
            continue
        pattern = rf"(?<![\w.-]){re.escape(action.dest)}=('[^']*'|\"[^\"]*\"|[^\s,;:)\]]+)"
        message = re.sub(pattern, lambda m, f=longs[0]: f"{f} {m.group(1).strip(_QUOTES)}", message)
    return message


def quiet_progress_bars() -> None:
    """--quiet: no progress bars from the libraries a build runs either (transformers' "Loading
    weights", the GGUF reader's tqdm, huggingface_hub's downloads). tqdm reads TQDM_DISABLE when
    it is first imported, so this runs before the build imports anything."""
    import os
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:     # the build says what is missing
        return
    hf_logging.disable_progress_bar()
