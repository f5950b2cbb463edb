"""The engine: what a stage is (registry), what a model needs (planner), who computes it
(supervised worker processes) and how Prefect shows it (model flow). See docs/architecture.md.

Import direction inside the engine: context <- registry <- planner <- bookkeeping <- model_flow;
compute and worker run inside worker processes; pool supervises them from the orchestrator.
"""
