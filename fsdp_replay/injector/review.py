"""AdmissionReview v1, as typed dicts (kopf's ``reviews.py`` habit), its parser and a pure response builder.

Only ``admission.k8s.io/v1`` is accepted: ``v1beta1`` was removed from the API server in 1.22, and a
MutatingWebhookConfiguration lists ``admissionReviewVersions: ["v1"]``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any, Literal, TypedDict

from fsdp_replay.injector.errors import BadReviewError
from fsdp_replay.injector.patch import Op

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]


class UserInfo(TypedDict, total=False):
    username: str
    uid: str
    groups: list[str]
    extra: dict[str, list[str]]


class GroupVersionKind(TypedDict):
    group: str
    version: str
    kind: str


class GroupVersionResource(TypedDict):
    group: str
    version: str
    resource: str


class _RequestRequired(TypedDict):
    uid: str


class Request(_RequestRequired, total=False):
    """``AdmissionReview.request``: what the API server asks about one object."""

    kind: GroupVersionKind
    resource: GroupVersionResource
    subResource: str
    requestKind: GroupVersionKind
    requestResource: GroupVersionResource
    requestSubResource: str
    name: str
    namespace: str
    operation: Operation
    userInfo: UserInfo
    object: dict[str, Any]
    oldObject: dict[str, Any] | None
    dryRun: bool
    options: dict[str, Any] | None


class RequestReview(TypedDict):
    apiVersion: str
    kind: str
    request: Request


class ResponseStatus(TypedDict, total=False):
    code: int
    message: str
    reason: str


class _ResponseRequired(TypedDict):
    uid: str
    allowed: bool


class Response(_ResponseRequired, total=False):
    """``AdmissionReview.response``: the verdict, and for a mutation the base64 JSON Patch."""

    status: ResponseStatus
    patch: str
    patchType: Literal["JSONPatch"]
    warnings: list[str]
    auditAnnotations: dict[str, str]


class ResponseReview(TypedDict):
    apiVersion: str
    kind: str
    response: Response


def parse_review(body: bytes) -> Request:
    """The request of an AdmissionReview v1; raises :class:`BadReviewError` saying what is wrong."""
    try:
        review = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
        raise BadReviewError(f"the body is not JSON: {e}") from None
    if not isinstance(review, dict):
        raise BadReviewError(f"expected an AdmissionReview object, got a JSON {type(review).__name__}")
    api_version, kind = review.get("apiVersion"), review.get("kind")
    if kind != KIND:
        raise BadReviewError(f"kind is {kind!r}, expected {KIND!r}")
    if api_version != API_VERSION:
        raise BadReviewError(
            f"apiVersion is {api_version!r}; only {API_VERSION!r} is served "
            "(list admissionReviewVersions: [v1] in the webhook configuration)"
        )
    request = review.get("request")
    if not isinstance(request, dict):
        raise BadReviewError("the AdmissionReview has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReviewError("request.uid is missing: the response could not be matched to the request")
    kind = request.get("kind")
    if not isinstance(kind, dict) or not isinstance(kind.get("kind"), str):
        raise BadReviewError("request.kind is missing: expected {group, version, kind} of the object")
    obj = request.get("object")
    if request.get("operation", "CREATE") in ("CREATE", "UPDATE") and not isinstance(obj, dict):
        raise BadReviewError(
            f"request.object is missing or not an object for {request.get('operation', 'CREATE')}"
        )
    return request  # type: ignore[return-value]


def build_response(
    request_uid: str, patch: Sequence[Op], warnings: Sequence[str], allowed: bool = True
) -> ResponseReview:
    """The AdmissionReview answering ``request_uid``: the patch (if any, base64 JSON Patch) and warnings."""
    response: Response = {"uid": request_uid, "allowed": allowed}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(list(patch), separators=(",", ":")).encode()).decode()
    if warnings:
        response["warnings"] = list(warnings)
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}
