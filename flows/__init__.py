"""Prefect flows, the config schema and the CLI: the only layer that sees stages, storage and Prefect together.

Importing this package imports neither torch nor Prefect; the modules that need them do.
"""
