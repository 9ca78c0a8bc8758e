"""What every section shares: :class:`Section`, the base of every section model (unknown keys refused,
assignments validated), and the errors a config raises, :class:`ConfigError` for the user and
:class:`SectionCheckError` for a section's own check.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, with the dotted path of the field at fault."""


class SectionCheckError(ValueError):
    """A section's own check across its fields failed. The message starts with the dotted path of the field
    it names, so the loader shows it bare, as it shows a check across sections."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
