"""What every request model of the API shares: unknown fields accepted and ignored (clients
send many harmless extras), integers and booleans strict, so `"max_tokens": "5"` or
`"stream": "yes"` is a 400."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

INT64 = 2**63 - 1

Int = StrictInt
Bool = StrictBool
# Floats accept JSON integers (1 is a fine temperature) but not strings.
Float = Annotated[float, Field(strict=True)]


class Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)
