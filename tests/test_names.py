"""lnmonitor.views.names: the one rule that shortens a norm's name for display."""

from __future__ import annotations

from lnmonitor.views.names import name_prefix, short_name, short_names


def test_names_lose_their_shared_prefix_and_a_cut_is_marked():
    names = ["model.model.layers.0.post_attention_layernorm", "model.model.norm"]
    assert name_prefix(names) == "model.model."
    assert short_names(names) == ["layers.0.post_attention_layernorm", "norm"]
    assert short_names(["model.lnf"]) == ["lnf"]  # a lone name keeps its last part
    assert short_names(["a.x", "b.x"]) == ["a.x", "b.x"]  # nothing shared, nothing dropped
    cut = short_names(["m.layers.10.post_feedforward_layernorm", "m.norm"], width=20)[0]
    assert len(cut) == 20 and "..." in cut
    head, tail = cut.split("...")
    assert "layers.10.post_feedforward_layernorm".startswith(head) and tail and (
        "layers.10.post_feedforward_layernorm".endswith(tail))


def test_one_name_is_shown_as_among_the_others():
    names = ["model.model.layers.0.input_layernorm", "model.model.layers.10.post_feedforward_layernorm",
             "model.model.norm"]
    assert [short_name(n, names) for n in names] == short_names(names)
    assert short_name("model.model.norm", names[:2]) == "norm"  # among others it is not one of
    cut = short_name(names[1], names, width=20)
    assert len(cut) == 20 and cut.startswith("layers.") and cut.endswith("layernorm")
    assert short_name("model.lnf", []) == "lnf"  # alone, its last part
