"""The run path in the orchestrating process: the planner (key chain and cache decisions), stage
keys, the supervisor of a worker process and the pool of them, the runner of a model's stages, the model flow
(Prefect tasks), bookkeeping and index records, validate's preflight, and the fleet's plan.

May import common/, environment/, lineage/, services/ and worker/'s message types; the planner,
runner, stage keys and fleet plan import neither torch nor Prefect (a fleet the index settles
is answered without either).
"""
