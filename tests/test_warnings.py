"""Warnings: a deprecated name warns at the line that used it, and a DeprecationWarning raised from the
packages' own code fails the suite (pyproject.toml's ``filterwarnings``)."""

import warnings

import pytest
from _pytest.config import parse_warning_filter

import fedopt_kernels.sim
import fedopt_kernels.sim.config


@pytest.mark.parametrize("module", [fedopt_kernels.sim, fedopt_kernels.sim.config], ids=["sim", "sim.config"])
def test_the_old_name_of_variants_warns_at_the_callers_line(module):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert module.ALGORITHMS is fedopt_kernels.sim.VARIANTS
    assert [w.category for w in caught] == [DeprecationWarning]
    assert caught[0].filename == __file__ and "VARIANTS" in str(caught[0].message)


def _raises_under_the_suites_filters(pytestconfig, module: str) -> bool:
    """Whether a DeprecationWarning attributed to ``module`` is an error under the ini's filters."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for spec in pytestconfig.getini("filterwarnings"):
            warnings.filterwarnings(*parse_warning_filter(spec, escape=False))
        try:
            warnings.warn_explicit("old", DeprecationWarning, "x.py", 1, module=module)
        except DeprecationWarning:
            return True
    return False


@pytest.mark.parametrize("module", ["fedopt_kernels", "fedopt_kernels.sim.config", "triton_kernels.common"])
def test_a_deprecation_from_the_packages_fails_the_suite(pytestconfig, module):
    assert _raises_under_the_suites_filters(pytestconfig, module)


@pytest.mark.parametrize("module", ["torch.optim.sgd", "test_api", "fedopt_kernels_extra"])
def test_a_deprecation_from_elsewhere_is_only_reported(pytestconfig, module):
    """The check can fail: the filters single out the packages, not every module (third-party
    deprecations seen on one torch version only would otherwise turn a run red)."""
    assert not _raises_under_the_suites_filters(pytestconfig, module)


def test_the_old_module_of_the_initial_controls_strategy_warns_at_the_importing_line():
    pytest.importorskip("flwr")
    import sys

    from fedopt_kernels.flower.initial_controls import InitialControlsStrategy

    sys.modules.pop("fedopt_kernels.flower.padamfed", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from fedopt_kernels.flower.padamfed import InitialControlsStrategy as old
    assert old is InitialControlsStrategy
    assert [w.category for w in caught] == [DeprecationWarning]
    assert caught[0].filename == __file__ and "initial_controls" in str(caught[0].message)
