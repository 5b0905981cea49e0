"""`/v1/embeddings` on the bundled model (the chat-model fallback: mean pooling of SmolLM2's last
hidden state) through the openai client on a real server; the vectors are unit length and the
same text gives the same vector whatever else is in the batch."""

import numpy as np

from live_server import engine_serving, openai_client

TEXTS = ["Local models keep your data private.", "hi", "A much longer sentence that pads the "
         "others in the batch, so that padding and masking are exercised for real."]


def test_bundled_model_embeds_through_the_openai_client(tmp_path):
    with engine_serving(tmp_path) as server:
        client = openai_client(server)
        name = server.app.state.engine.model_name
        got = client.embeddings.create(model=name, input=TEXTS)
        vectors = np.array([d.embedding for d in got.data])
        assert got.model == name and vectors.shape == (3, 576)
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        assert got.usage.prompt_tokens > 3
        for i, text in enumerate(TEXTS):  # alone: no batch, no padding
            alone = client.embeddings.create(model=name, input=text, encoding_format="float")
            assert np.abs(np.array(alone.data[0].embedding) - vectors[i]).max() < 1e-5
        assert abs(float(vectors[0] @ vectors[1])) < 0.9999  # different texts, different vectors
