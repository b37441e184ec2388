"""The FSDP2 training backend: torch ``fully_shard`` over any Hugging Face causal LM.

The only package that imports ``torch.distributed.fsdp``, ``torch.distributed.checkpoint`` (DCP) and
their state-dict helpers, as rlmega/megatron/ is the only one importing megatron.core.
    engine.py         FSDPEngine: rlmega.learner.engine_api.TrainEngine over the model manager
    model_manager.py  FSDPModelManager: model, optimizer, LR schedule, offload, export (RLinf's names)
    checkpoint.py     sharded DCP checkpoints in the shared step_N / latest layout
    vision_inputs.py  a vision-language model's images and mRoPE positions in a packed row
"""
