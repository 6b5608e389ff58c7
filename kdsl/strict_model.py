"""The one base class every validated model shares: the definitions' (kdsl.schema) and the kernel units' options
(kdsl.kernels), which the schema validates against. Outside both packages, so neither imports the other to get it."""
from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown fields are errors, values are never coerced across types, instances are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
