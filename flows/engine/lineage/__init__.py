"""OpenLineage run events of every stage (events.py; off unless configured), emitted by the
orchestrator. May import common/ and environment/.
"""
