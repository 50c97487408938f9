"""The optional packages: kdcache.extras imports the module a feature names, and names the extra of
pyproject.toml that installs it when it cannot."""
import re
import tomllib

import pytest

from kdcache import extras
from kdcache.pipeline.errors import PipelineError
from tests.conftest import ROOT


def test_require_gives_the_module_named_submodules_too():
    image = extras.require("PIL.Image", "exporting", PipelineError)
    assert image.__name__ == "PIL.Image" and callable(image.open)
    assert extras.require("sklearn.datasets", "digits", PipelineError).load_digits


def test_a_module_that_cannot_be_imported_is_one_line_naming_its_extra():
    with pytest.raises(PipelineError) as e:
        extras.require("sklearn.no_such_module", "--dataset digits", PipelineError)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--dataset digits needs scikit-learn, which cannot be imported here (")
    assert "sklearn.no_such_module" in msg and msg.endswith("pip install 'kdcache[datasets]'")


def test_each_extra_named_installs_the_package_it_is_named_for():
    with open(f"{ROOT}/pyproject.toml", "rb") as fh:
        declared = tomllib.load(fh)["project"]["optional-dependencies"]
    for module, (dist, extra) in extras.EXTRAS.items():
        names = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in declared[extra]}
        assert dist.lower() in names, (module, dist, extra, declared[extra])
