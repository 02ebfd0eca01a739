"""The control API's requests and errors, shared by the server and the client (JSON only)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict

TOKEN_HEADER = "Authorization"
MAX_STEP = 999_999_999


def _step_from(low: int) -> AfterValidator:
    """A check that a step lies in low..MAX_STEP (the message names both)."""

    def check(step: int) -> int:
        if not low <= step <= MAX_STEP:
            raise ValueError(f"step {step} is outside the allowed range {low}..{MAX_STEP}")
        return step

    return AfterValidator(check)


# Strict: a step is a JSON integer; `true`, `"1"` or `1.0` are refused, not read as 1.
TrainedStep = Annotated[int, Strict(), _step_from(1)]
WeightsStep = Annotated[int, Strict(), _step_from(0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainStepRequest(_Request):
    """Train step N on the rows pinned to N.

    `pin_version`, the `batches` commit that pinned N when the caller just made it, lets the
    engine read the rows from the file that commit added instead of scanning the table.
    `publish`: then publish step N's weights as `publish_weights` would, in the same command
    (the reply's `published`; None when the step's health problems withhold them).
    """

    step: TrainedStep
    pin_version: Annotated[int, Strict(), Field(ge=0)] | None = None
    publish: Annotated[bool, Strict()] = False


class SaveCheckpointRequest(_Request):
    """Make sure a complete checkpoint of step N exists (the engine must be at N to write one)."""

    step: TrainedStep
    block: bool = Field(default=True, description="Wait until the checkpoint is complete.")
    hf: bool = Field(default=False, description="Also export a Hugging Face directory.")
    serves_as_sync: bool = Field(
        default=False, description="The HF export becomes published weights version N."
    )


class WeightsStepRequest(_Request):
    """A weights step N: publish it on disk, upload it to shared memory, or stage it for
    collective transfers."""

    step: WeightsStep


class WeightsTransferRequest(_Request):
    """Send held weights `version` to the explorer `receiver` over a collective group."""

    version: WeightsStep
    receiver: str = Field(min_length=1, max_length=200)


class CommandError(Exception):
    """A command the engine refused or failed; `status` is the HTTP status to answer with."""

    status = 500

    def __init__(self, message: str, traceback_text: str = "") -> None:
        super().__init__(message)
        self.traceback_text = traceback_text


class StepConflictError(CommandError):
    """A command that does not fit the engine's step (out of order; the message names the steps)."""

    status = 409


class BadRequestError(CommandError):
    """Invalid input: a bad batch, a missing file, an unknown step."""

    status = 422


def error_payload(err: BaseException, traceback_text: str) -> dict:
    """The JSON body of a failed command."""
    return {"error": str(err), "type": type(err).__name__, "traceback": traceback_text}
