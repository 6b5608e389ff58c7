"""The one base class every definition model shares."""
from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown fields are errors, values are never coerced across types, instances are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
