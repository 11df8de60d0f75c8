"""build_response: the Response every model server returns."""

from rollgym import build_response
from rollgym.schema import ModelResponse


def test_created_at_is_whole_seconds_as_openai_sends_it() -> None:
    response = build_response({"input": "hi"}, [], model="m")
    assert type(response["created_at"]) is int and response["created_at"] > 1_700_000_000
    ModelResponse.model_validate(response)
