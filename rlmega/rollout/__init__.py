"""The engine side of rollouts: RolloutWorker (rollout.py) and its parts, one vLLM engine each.

The weight-sync hand-over it shares with the trainer is in rlmega/sync/; the run's coordinator
(ActorManager) is rlmega/launch/coordinator.py."""
