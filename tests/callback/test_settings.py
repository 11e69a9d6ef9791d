"""LPA3Callback's settings: the groups, the preset, and the messages for a setting given wrong."""

from __future__ import annotations

import dataclasses

import pytest

from lpa3_lightning import LPA3Callback
from lpa3_lightning.callback import CacheSettings, SelectionSettings, SolverSettings


def test_an_explicit_group_wins_over_the_preset():
    """A group the user gives is what runs, field by field, even where a field equals its default."""
    explicit = SolverSettings(project=True, max_step="auto", allow_tf32=False)
    callback = LPA3Callback(preset="authors", solver=explicit)
    assert callback.solver == explicit
    assert (callback.solver.project, callback.solver.max_step, callback.solver.allow_tf32) == (True, "auto", False)
    callback = LPA3Callback(preset="authors", selection=SelectionSettings(initial_selection="random"))
    assert callback.selection == SelectionSettings(initial_selection="random")
    # a mapping is the same group written another way
    assert LPA3Callback(preset="authors", solver={"max_step": 1.0}).solver == SolverSettings(max_step=1.0)


def test_a_group_left_out_takes_the_preset():
    authors = LPA3Callback(preset="authors")
    assert (authors.solver.project, authors.solver.max_step, authors.solver.allow_tf32) == (False, None, True)
    assert (authors.selection.initial_selection, authors.selection.threshold_rule,
            authors.selection.initial_memory) == ("all", "authors", "authors")
    # a group the preset does not touch keeps its defaults
    assert authors.cache == CacheSettings()
    # the preset's other groups stay when one group is given
    mixed = LPA3Callback(preset="authors", solver=SolverSettings(max_step=1.0))
    assert mixed.selection == authors.selection


def test_a_misspelled_argument_names_the_argument_it_resembles():
    with pytest.raises(TypeError, match=r"`sigme`.*did you mean `sigma`"):
        LPA3Callback(sigme=0.02)


@pytest.mark.parametrize("name, group", [("max_step", "solver"), ("regenerate_every_n_epochs", "cache"),
                                         ("memory_layout", "selection")])
def test_a_group_setting_given_at_the_top_names_its_group(name, group):
    with pytest.raises(TypeError, match=f"`{name}` is a setting of the `{group}` group"):
        LPA3Callback(**{name: 1})


@pytest.mark.parametrize("name, place", [("cache_dir", "cache.dir"), ("solver_fast", "solver.fast"),
                                         ("logging_num_images", "logging.num_images")])
def test_a_group_field_with_its_group_as_a_prefix_names_its_place(name, place):
    group, field = place.split(".")
    with pytest.raises(TypeError, match=rf"`{name}`: it is `{place}`.*`{group}={{'{field}': \.\.\.}}`"):
        LPA3Callback(**{name: 1})


@pytest.mark.parametrize("input_range", ["none", "0-1", b"01"])
def test_a_string_input_range_other_than_auto_is_refused_at_construction(input_range):
    with pytest.raises(ValueError, match="`input_range` must be 'auto', None"):
        LPA3Callback(input_range=input_range)


def test_a_setting_in_the_wrong_group_names_the_group_it_belongs_to():
    with pytest.raises(TypeError, match=r"`cache` has no setting `max_step`: it is a setting of the `solver` group"):
        LPA3Callback(cache={"max_step": 1.0})
    with pytest.raises(TypeError, match=r"`cache` has no setting `regenerate`.*regenerate_every_n_epochs"):
        LPA3Callback(cache={"regenerate": 2})


def test_the_groups_are_frozen_dataclasses():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SolverSettings().lam = 2.0  # type: ignore[misc]
