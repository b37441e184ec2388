"""A run's folder on disk, for the driver and both training backends (no backend import here).

run.py               RunDir: metrics, TensorBoard, config.yaml, which checkpoint to resume from
checkpoint_files.py  a checkpoint root's files: .partial, rename, ``latest``, undo, RNG state
checkpoint_scan.py   which checkpoint folders are complete, judged before any worker loads one
durable.py           writes that survive a crash (fsync of the file and of its folder)
stopping.py          StopRequest: signals and ``rlmega stop RUN_DIR`` (the folder's STOP file)
checkpoint_data.py   a checkpoint's index and saved objects read as data, never as code
shard_checksums.py   each shard's sha256, written at save and checked before a resume
startup.py           the start-up's phases, printed as they end and written to setup.json
plots.py             curves of one run or several, from their metrics.jsonl, into one PNG
profiling.py         torch profiler traces of chosen RL steps (logging.profile_steps)
"""
