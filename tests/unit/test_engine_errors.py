"""engine_root_cause on vLLM's log text: the engine core's last exception, not the caller's echo."""

from rlmega.rollout.engine_errors import engine_died, engine_root_cause

# vLLM's log lines verbatim (the parser's input): they stay as long as vLLM wrote them.
LOG = """\
(EngineCore pid=14652) INFO 11-24 23:13:40 [core.py:133] Initializing a V1 LLM engine
(EngineCore pid=14652) ERROR 11-24 23:13:41 [core.py:1512] EngineCore encountered a fatal error.
(EngineCore pid=14652) ERROR 11-24 23:13:41 [core.py:1512] Traceback (most recent call last):
(EngineCore pid=14652) ERROR 11-24 23:13:41 [core.py:1512]   File "/x/site-packages/vllm/v1/engine/core.py", line 676, in step
(EngineCore pid=14652) ERROR 11-24 23:13:41 [core.py:1512]     model_output = self.model_executor.sample_tokens(grammar_output)
(EngineCore pid=14652) ERROR 11-24 23:13:41 [core.py:1512]   File "/x/site-packages/vllm/v1/worker/gpu_model_runner.py", line 3502, in _bookkeeping_sync
(EngineCore pid=14652) ERROR 11-24 23:13:41 [core.py:1512]     gen.set_offset(gen.get_offset() - 4)
(EngineCore pid=14652) ERROR 11-24 23:13:41 [core.py:1512]                    ^^^^^^^^^^^^^^^^
(EngineCore pid=14652) ERROR 11-24 23:13:41 [core.py:1512] RuntimeError: CPU Generator does not use offset
(MainProcess pid=14519) ERROR 11-24 23:13:41 [async_llm.py:906] AsyncLLM output_handler failed.
(MainProcess pid=14519) ERROR 11-24 23:13:41 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
"""  # noqa: E501


def test_root_cause_is_the_engine_cores_exception_with_its_frame():
    assert engine_root_cause(LOG) == (
        "RuntimeError: CPU Generator does not use offset "
        "(in _bookkeeping_sync, vllm/v1/worker/gpu_model_runner.py:3502)"
    )


def test_no_engine_core_error_gives_none_and_the_message_says_so(tmp_path):
    assert engine_root_cause("(EngineCore pid=1) INFO x [core.py:1] fine\nplain line\n") is None
    log = tmp_path / "w.err"
    log.write_text("nothing here\n")
    msg = str(engine_died(RuntimeError("EngineCore encountered an issue"), [str(log)]))
    assert "root cause not found" in msg and str(log) in msg


def test_engine_died_reads_the_cause_from_the_log(tmp_path):
    log, other = tmp_path / "w.out", tmp_path / "w.err"
    log.write_text("x" * 100 + "\n" + LOG)
    other.write_text("unrelated\n")
    msg = str(engine_died(RuntimeError("dead"), [str(other), str(log)]))
    assert "CPU Generator does not use offset" in msg and f"engine log: {log}" in msg


def test_an_engine_death_is_found_inside_a_failed_requests_text():
    from rlmega.rollout.engine_errors import engine_death_in

    err = (
        "GenerationFailed('generation failed 3 times: RayTaskError(EngineDied)(\"ray::RolloutWorker.generate_one()"
        " ... EngineDied: the vLLM engine core died: RuntimeError: boom (in f, x.py:1) (engine log: /t/a.out)\\n"
        "more\")')"
    )
    assert (
        engine_death_in(err)
        == "the vLLM engine core died: RuntimeError: boom (in f, x.py:1) (engine log: /t/a.out)"
    )
    assert engine_death_in("generation failed 3 times: TimeoutError()") is None


def test_an_engine_start_failure_names_the_cores_exception_or_else_what_vllm_raised(tmp_path):
    from rlmega.rollout.engine_errors import engine_start_failed

    log = tmp_path / "w.out"
    log.write_text(LOG)
    said = RuntimeError(
        "Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    )
    assert str(engine_start_failed(said, [str(log)])) == (
        "the vLLM engine did not start: RuntimeError: CPU Generator does not use offset (in _bookkeeping_sync, "
        f"vllm/v1/worker/gpu_model_runner.py:3502) (engine log: {log})"
    )
    log.write_text("nothing logged\n")
    assert str(engine_start_failed(ValueError("bad arg\nmore"), [str(log)])) == (
        f"the vLLM engine did not start: ValueError: bad arg (engine log: {log})"
    )
