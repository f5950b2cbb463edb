"""What a run talks to besides the store: Prefect's environment and API server (shared or
private, prefect_runtime.py; the server process itself, prefect_server.py) and a Dask cluster's
workers (dask_cluster.py). Imports Prefect only inside the functions that need it.
"""
