"""The environment the workers run in: the interpreter and its versions (`run --python`), the
native toolchain identity compiled packages are keyed by, and overlay environments made from
others (upgrade-check's candidates and attribution).

May import common/ and stages' torch-free modules; never orchestrator/, worker/ or Prefect.
"""
