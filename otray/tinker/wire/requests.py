"""The JSON bodies of the Tinker routes, as frozen dataclasses: each body is parsed once, at the gateway's
route (after ``messages.check_request_fields`` checked the known fields' JSON types), and the TinkerService
methods take these, never a dict. Field names are the SDK's. A field sent as ``null`` takes its default;
a required field (one without a default) missing, ``null`` or ``""`` is a 400 naming it. Fields the service
does not read are dropped here (the SDK sends a ``type`` and more). The one protobuf body
(``forward_backward``) is decoded in one place too: ``messages.parse_train_call``, called by the service,
which holds the limits and the custom losses it is checked against.

Runs in the gateway's Serve replica (parsing) and the TinkerService actor (reading).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Optional, TypeVar

from otray.tinker.errors import UserError

B = TypeVar("B", bound="Body")


@dataclass(frozen=True)
class Body:
    """A route's body: :meth:`of` builds one from the decoded JSON object."""

    @classmethod
    def of(cls: type[B], data: dict[str, Any]) -> B:
        spec = fields(cls)
        missing = [f.name for f in spec if f.default is MISSING and f.default_factory is MISSING
                   and data.get(f.name) in (None, "")]
        if missing:
            raise UserError(f"missing field(s) {missing}")
        return cls(**{f.name: data[f.name] for f in spec if data.get(f.name) is not None})


@dataclass(frozen=True)
class CreateSession(Body):
    display_name: Any = None
    user_metadata: Any = None
    project_id: Any = None


@dataclass(frozen=True)
class Heartbeat(Body):
    session_id: str


@dataclass(frozen=True)
class FinishSession(Body):
    reason: Any = None  # {type: ...}: kept as the session's status
    detail: Any = None


@dataclass(frozen=True)
class CreateModel(Body):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: Optional[dict[str, Any]] = None
    optimizer_config: Optional[dict[str, Any]] = None
    user_metadata: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class GetInfo(Body):
    model_id: str


@dataclass(frozen=True)
class GraphUpload(Body):
    """A custom loss as the SDK traces it: its graph, name and inputs (``learner.loss_graph`` reads it)."""

    graph: dict[str, Any]
    name: Any = None
    inputs: Any = None


@dataclass(frozen=True)
class CreateCustomLoss(Body):
    session_id: str
    custom_loss_seq_id: int
    graph: dict[str, Any]
    name: Any = None
    inputs: Any = None

    @property
    def upload(self) -> GraphUpload:
        return GraphUpload(self.graph, self.name, self.inputs)


@dataclass(frozen=True)
class OptimStep(Body):
    model_id: str
    seq_id: Optional[int] = None
    adam_params: Optional[dict[str, Any]] = None
    optim_params: Optional[dict[str, Any]] = None
    optimizer_params: Optional[dict[str, Any]] = None

    @property
    def params(self) -> dict[str, Any]:
        """The optimizer's parameters, under whichever name the SDK version sent them."""
        return self.adam_params or self.optim_params or self.optimizer_params or {}


@dataclass(frozen=True)
class SaveWeights(Body):
    """``save_weights``, ``save_weights_for_sampler`` and ``save_weights_external`` alike."""

    model_id: str
    seq_id: Optional[int] = None
    path: Optional[str] = None  # the checkpoint's name
    ttl_seconds: Optional[float] = None
    overwrite: bool = False
    user_metadata: Optional[dict[str, Any]] = None
    age_encryption_recipients: Any = None
    sampling_session_seq_id: Optional[int] = None
    kind: str = "snapshot"  # save_weights_for_sampler: snapshot (fixed weights) | inflight (the model's shared target)


@dataclass(frozen=True)
class LoadWeights(Body):
    """Into a live model (``model_id``, in its order) or create-via-load (``session_id`` + ``model_seq_id``)."""

    path: str
    model_id: Optional[str] = None
    seq_id: Optional[int] = None
    optimizer: bool = False
    session_id: Optional[str] = None
    model_seq_id: Optional[int] = None
    base_model: Optional[str] = None
    user_metadata: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class MergeWeights(Body):
    path: str
    name: str
    ttl_seconds: Optional[float] = None
    overwrite: bool = False


@dataclass(frozen=True)
class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: Optional[str] = None
    model_path: Optional[str] = None


@dataclass(frozen=True)
class ASample(Body):
    """``asample``: the prompt (a ModelInput), how to sample, and the scores asked for beside the samples."""

    prompt: dict[str, Any]
    sampling_params: dict[str, Any]
    num_samples: int = 1
    sampling_session_id: Optional[str] = None
    seq_id: Optional[int] = None
    model_path: Optional[str] = None
    base_model: Optional[str] = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: Any = 0
    topk_sample_logprobs: Any = 0
    prompt_alt_tokens_k: Any = 0
    target_prompt_logprobs: Any = None
    prompt_logprobs_last_n: Optional[int] = None
    record_stability_info: bool = False


@dataclass(frozen=True)
class CancelFuture(Body):
    request_id: str


@dataclass(frozen=True)
class RetrieveFutures(Body):
    target: Any
    prev_cursor: Any = 0
    timeout: Any = None


@dataclass(frozen=True)
class SearchSessions(Body):
    """``search_sessions``: the SDK's SessionSearchRequest (its values checked in ``service.session_search``)."""

    limit: Any = 50
    owner: Any = None
    session_id: Any = None
    display_name: Any = None
    project_ids: Any = None
    user_metadata: Any = None
    statuses: Any = None
    cursor: Any = None
