"""Agent loops: one prompt -> a group of trajectories through the engine router, judged by the
loop's own judgers (XTuner-style: each agent loop owns its judger configuration).

    trajectory.py  Trajectory / TrajectoryGroup and their conversion to the trainer's RolloutBatch
    router.py      EngineRouter: requests to the least-outstanding engine, retried on failure
    loop.py        AgentLoop (base), SingleTurnAgentLoop, ToolAgentLoop (multi-turn, token in / token out)
    hosting.py     AgentLoopHost: a loop in this process, in one Ray actor, or N actors behind a router
    tasks.py       Tasks: several (prompts, agent loop, weight) mixed in each step's batch
    tools.py, tool_protocol.py   the tools a ToolAgentLoop may call and their <tool>/<result> text
"""
