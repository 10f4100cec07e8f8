"""The OpenAI endpoint's refusal: a status and an error body naming the field (`param`), as
OpenAI's own errors do."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
