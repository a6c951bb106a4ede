"""The one server test on the default SmolLM2 engines: a streamed chat through the
official client is token-for-token `SpeculativeGenerator.generate`."""
from __future__ import annotations

import openai
import pytest

from specrt.runtime import SpeculativeGenerator

from .serve_helpers import WAIT_S, LiveServer


@pytest.mark.real_model
def test_streamed_greedy_chat_on_the_default_engines_equals_the_runtime(real_engines):
    question = "Name three colors."
    want = SpeculativeGenerator(real_engines, methods=("speculative",)).generate(question, chat=True,
                                                                                max_new_tokens=40)
    server = LiveServer(real_engines, workers=1)
    try:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
        chunks = list(oai.chat.completions.create(model=server.model, messages=[{"role": "user", "content": question}],
                                                  max_tokens=40, temperature=0, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.text and len(want.tokens) > 5
        assert chunks[-1].choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
        m = server.metrics()
        # the server's one worker ran the generator's rounds (the default folder's batch of one
        # chooses them by measured cost: pair, lookup or draft rounds, or plain steps)
        assert m[("specrt_spec_decode_draft_tokens_total", frozenset())] == want.metrics.drafted
        assert m[("specrt_spec_decode_accepted_tokens_total", frozenset())] == want.metrics.accepted
    finally:
        server.close()
