from pyserve.replicas.request_text import routing_text


def test_a_longer_conversation_extends_the_shorter_ones_text():
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "hello"},
                     {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    a = routing_text("/v1/chat/completions", {"messages": first})
    b = routing_text("/v1/chat/completions", {"messages": later})
    assert b.startswith(a) and len(b) > len(a)
    assert "more" in b


def test_prompts_token_ids_and_batches():
    assert routing_text("/v1/completions", {"prompt": "def f():"}) == "def f():"
    assert routing_text("/v1/completions", {"prompt": [1, 22, 3]}) == "1 22 3 "
    assert routing_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert routing_text("/v1/completions", {"prompt": [[5, 6], [7]]}) == "5 6 "
    assert routing_text("/v1/embeddings", {"input": "text"}) == "text"


def test_bodies_of_another_shape_route_by_nothing():
    assert routing_text("/v1/chat/completions", {"messages": "nope"}) == ""
    assert routing_text("/v1/completions", None) == ""
    assert routing_text("/v1/completions", {"prompt": 3}) == ""
