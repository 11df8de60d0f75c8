"""`rollgym eval`: environments × models through the rollout collector, and a report with honest error bars.

suite (what to run), models (which weights), runner (the collections), report (the figures and their
renderings), stats (pass@k, intervals clustered by task, paired comparisons).
"""
