"""The run's read-only web dashboard: ``make_app(manager)`` (FastAPI), served by ``ActorManager``."""
