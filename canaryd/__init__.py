"""canaryd: known-answer canaries for LLM serving stacks.

Data flows one way: config → scheduler → probe (backend) → observation + stack snapshot → store →
compare → metrics/alerts/reports. Each arrow is a module named for what it holds.
"""

# The one place the version is written: pyproject.toml reads it (dynamic), and so does the code (--version,
# canaryd_build_info, pins, records, the User-Agent) without asking installed metadata for a distribution
# name (the wheel is llm-canaryd; PyPI's canaryd is an unrelated project).
__version__ = "0.1.0"
