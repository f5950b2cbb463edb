"""The version of the orchestrator <-> worker protocol (flows/engine/common/messages.py: the messages and the
worker's control messages). An orchestrator starts workers under another interpreter (`run
--python`) only when that interpreter's pt2flow speaks the same protocol: bump this whenever a
message changes shape. Imports nothing, so an interpreter can be asked for it without torch."""

WORKER_PROTOCOL = 4  # 2: the engine's modules moved into subpackages (the worker's entry point and the pickled messages' classes); 3: every message a dataclass of engine/common/messages.py; 4: workers forked from a fork server (flows/engine/worker/forkserver.py)
