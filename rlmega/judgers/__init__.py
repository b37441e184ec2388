"""Judgers: score finished trajectories with named scores and a reward (DESIGN.md, "Rollouts as agents").

    from rlmega.judgers import JudgeItem, build_judger
    judge = build_judger(cfg.agent_loop.judgers, cfg.reward)          # a CompositeJudger
    verdict = await judge.judge(JudgeItem(prompt_text, response_text, label))
    verdict.reward, verdict.scores, verdict.error

Kinds (one module each, imported only when used): native.py (a dotted-path function in this process),
ray_actors.py (the same function in N Ray actors, least-outstanding routing, dead actors restarted),
http.py (POST to a service), model.py (a judge model on its own vLLM engine). composite.py combines an
agent loop's judgers by weight; factory.py builds them from JudgerConfig; rlmega/config/judger_rules.py
checks the config at load (validate_judgers, re-exported here). Failures never raise: they score 0 with an
error string naming the judger (base.py).
"""

from rlmega.config.judger_rules import validate_judgers
from rlmega.judgers.base import JudgeError, Judgement, Judger, JudgeItem
from rlmega.judgers.composite import CompositeJudger
from rlmega.judgers.factory import build_judger

__all__ = [
    "Judger",
    "JudgeItem",
    "Judgement",
    "JudgeError",
    "CompositeJudger",
    "build_judger",
    "validate_judgers",
]
