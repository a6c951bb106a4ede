"""A small set of varied real prompts: used by `specrt bench`, by the calibration
agreement measurement, and by the end-to-end tests. Kept in code so nothing is
fetched at run time."""

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when you would use one instead of a list.",
    "What are the main causes of the French Revolution? Answer in a few sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for improving my sleep.",
    "Summarize the water cycle for a ten-year-old.",
    "Translate 'Good morning, how are you today?' into French and Spanish.",
    "List the planets of the solar system in order from the sun, with one fact about each.",
    "What is the difference between weather and climate?",
    "Write a haiku about autumn leaves.",
]
