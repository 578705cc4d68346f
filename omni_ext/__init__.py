"""omni-ext: a pip-installable plugin for vLLM-Omni diffusion serving.

Everything is wired from :mod:`omni_ext.plugin` through Python entry points; importing this package
is cheap and has no side effects.
"""

#: The one place the version is kept: pyproject.toml reads it ([tool.setuptools.dynamic]).
__version__ = "0.1.0"
#: The command that writes the generated reference pages (``docs/reference/``, :mod:`omni_ext.reference`).
#: Kept here, not there: the modules whose pages it writes name it, and the reference imports them.
REGENERATE_DOCS = "python -m omni_ext.reference"
