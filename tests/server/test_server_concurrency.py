"""The serving path under concurrency: requests prepared on several worker threads at once (as
the server prepares each HTTP call off its event loop) each get a request id of their own and
each hear their end."""

from __future__ import annotations

import threading

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.engine.loop import Delta, EngineLoop
from tests.helpers import TINY


def test_requests_submitted_from_two_threads_at_once_get_their_own_ids_and_finish(monkeypatch):
    """Two submissions interleaved inside ``make_request`` (held at a barrier while checking
    their sampling parameters) once took the same id: the engine loop kept one listener per id,
    so one client waited forever for a request the engine had finished."""
    barrier = threading.Barrier(2, timeout=5)
    check = SamplingParams.check_vocabulary

    def interleaved(self, vocab_size):
        barrier.wait()
        return check(self, vocab_size)

    monkeypatch.setattr(SamplingParams, "check_vocabulary", interleaved)
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    ended = {i: threading.Event() for i in range(2)}
    ids: dict[int, int] = {}
    with LLM(config=ModelConfig(**TINY["qwen3_moe"])) as llm:
        loop = EngineLoop(llm).start()

        def submit(i: int) -> None:
            def listener(delta: Delta) -> None:
                if delta.finish_reason or delta.error:
                    ended[i].set()

            ids[i] = loop.submit([1, 2, 3 + i], params, listener).request_id

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            assert ids[0] != ids[1]
            assert all(e.wait(30) for e in ended.values()), "a request never heard its end"
        finally:
            loop.stop()
