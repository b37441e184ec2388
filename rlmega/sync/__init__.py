"""Moving trained weights into the rollout engines (see transports.py and parity.py;
the Megatron side is MegatronActor.sync_model_to_rollout)."""
