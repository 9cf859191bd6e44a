"""The control plane: the ResourceManager actor and what it owns (users, keys, jobs, leases, checkpoints).

``resource_manager`` (the API), ``gate`` (who is calling), ``scheduler`` (fair placement, drivers),
``lease`` (a job's placement group and its JobDriver actor), ``registry`` (SQLite),
``checkpoint_store`` (checkpoints as blobs through Ray). What it answers is typed in ``otray.records``.
"""
