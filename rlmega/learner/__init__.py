"""The learner: its interface to the driver and its RL logic, written once over a backend engine. The backends
(rlmega/megatron/, rlmega/fsdp/) implement engine_api.TrainEngine and are imported only on the trainer ranks.

    actor_api.py     the policy's interface on every trainer rank (Actor), and the backend's class by name
    critic_api.py    the value model's interface (Critic), for algorithm.advantage_estimator: gae
    engine_api.py    what only a backend can do for one model on one rank: forward, backward, weights in and out
    policy_actor.py  PolicyActor: the RL learner (log-probs, losses, steps, weight sync), over a TrainEngine
    value_critic.py  ValueCritic: PPO's value model, over a TrainEngine
    lora.py          LoRA adapters on the policy (peft's layers) and the tensors that leave it
    offload.py       tensors' storages to host memory and back, byte for byte
"""
