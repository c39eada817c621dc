"""canaryd: known-answer canaries for LLM serving stacks.

Data flows one way: config → scheduler → probe (backend) → observation + stack snapshot → store →
compare → metrics/alerts/reports. Each arrow is a module named for what it holds.
"""
