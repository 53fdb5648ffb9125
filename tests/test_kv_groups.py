"""KV cache groups: layers grouped by window as vLLM's `_get_kv_cache_groups_uniform_page_size`
groups them (its docstring's and comments' examples)."""

from __future__ import annotations

import pytest

from slipstream.serve.kv_groups import group_layers


def test_one_kind_is_one_group_of_every_layer():
    """Dense and all-windowed models keep today's layout: slot l for layer l."""
    for window in (None, 4096):
        groups = group_layers([window] * 5)
        assert groups.windows == (window,) and groups.layer_groups == (0,) * 5
        assert groups.layer_slots == (0, 1, 2, 3, 4) and groups.num_slots == 5


def test_n_to_one_patterns_group_by_the_one():
    """Gemma 3's 5:1 makes 6 groups of one layer; vLLM's 10 full + 20 windowed: 3 groups of 10,
    the windowed kind's two groups taking every other windowed layer."""
    gemma3 = group_layers([512] * 5 + [None])
    assert gemma3.num_groups == 6 and gemma3.num_slots == 1 and gemma3.windows.count(None) == 1
    windows = [None if i % 3 == 2 else 128 for i in range(30)]
    groups = group_layers(windows)
    assert groups.num_slots == 10 and sorted(groups.windows, key=str) == [128, 128, None]
    windowed = [i for i in range(30) if windows[i] is not None]
    first = groups.layer_groups[windowed[0]]
    assert [i for i in range(30) if groups.layer_groups[i] == first] == windowed[0::2]


def test_near_equal_kinds_pad_rather_than_split():
    """12 windowed + 13 full layers (gpt-oss-20b with a drafter, vLLM's example): two groups of 13
    slots, the windowed one leaving a slot idle; gpt-oss's 1:1 is two groups of half the layers."""
    groups = group_layers([64] * 12 + [None] * 13)
    assert groups.num_groups == 2 and groups.num_slots == 13
    assert group_layers([128, None] * 12).num_slots == 12


def test_disabled_is_one_windowless_group():
    groups = group_layers([512] * 5 + [None], hybrid=False)
    assert groups.windows == (None,) and not groups.has_windows and groups.num_slots == 6


@pytest.mark.parametrize("windows", [[], [0], [None, -3], [True], [2.5]])
def test_bad_windows_are_value_errors(windows):
    with pytest.raises(ValueError, match="sliding window|at least one layer"):
        group_layers(windows)


def test_a_window_no_position_outgrows_is_full_attention():
    """Gemma 2's 4096-token window at max_model_len 4096 never puts a block before it: one group;
    at a length where position max_model_len - 1 puts a whole block before the window, two."""
    gemma2 = [4096, None] * 13
    assert group_layers(gemma2, max_model_len=4096, block_size=16).windows == (None,)
    assert group_layers(gemma2, max_model_len=4096 + 15, block_size=16).num_groups == 1
    assert group_layers(gemma2, max_model_len=4096 + 16, block_size=16).num_groups == 2
    assert group_layers(gemma2).num_groups == 2
