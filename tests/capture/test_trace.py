"""capture/trace.py: what a capture tells while it runs."""

from __future__ import annotations


def test_a_capture_says_which_layer_its_forward_has_reached(tiny_dirs, monkeypatch):
    """Issue 40.6: a long capture's heartbeat names where it is: the stage names each decoder layer in turn
    (the config's num_hidden_layers of them), then the backward, then goes back to what it was."""
    from fxworkload.capture import trace
    from fxworkload.pipeline import extract
    from fxworkload.progress import set_stage, stage

    seen = []
    monkeypatch.setattr(trace, "set_stage", lambda text: (seen.append(text), set_stage(text)))
    set_stage("capturing")
    extract(str(tiny_dirs["llama4"]), seq=8, device="h100-sxm", every_layer=True, use_cache=False)
    layers = [text for text in seen if ": forward, layer " in text]
    assert layers == [f"capturing: forward, layer {i} of 4" for i in range(1, 5)]
    assert seen[len(layers)] == "capturing: backward" and stage() == "capturing"
