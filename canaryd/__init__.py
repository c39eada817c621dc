"""canaryd: known-answer canaries for LLM serving stacks.

Data flows one way: config → scheduler → probe (backend) → observation + stack snapshot → store →
compare → metrics/alerts/reports. Each arrow is a module named for what it holds.
"""

# The distribution's name, for importlib.metadata: PyPI's "canaryd" is an unrelated project, so the wheel is
# llm-canaryd while the command and the import package stay canaryd.
DISTRIBUTION = "llm-canaryd"
