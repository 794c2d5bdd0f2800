"""One module per guard. ``GUARDS`` is the order in which they appear everywhere."""

from .abort_before_arrival import AbortBeforeArrivalGuard
from .abort_state_release import AbortStateReleaseGuard
from .admission_drain import AdmissionDrainGuard
from .decode_admission_fit import DecodeAdmissionFitGuard
from .decode_deferred_release import DecodeDeferredReleaseGuard
from .decode_destination_hold import DecodeDestinationHoldGuard
from .decode_rejection_notice import DecodeRejectionNoticeGuard
from .destination_canary import DestinationCanaryGuard
from .empty_prompt import EmptyPromptGuard
from .flush_barrier import FlushBarrierGuard
from .hybrid_pool_check import HybridPoolCheckGuard
from .input_limit_message import InputLimitMessageGuard
from .mooncake_batch_bound import MooncakeBatchBoundGuard
from .page_generation import PageGenerationGuard
from .pool_capacity import PoolCapacityGuard
from .prefill_admission_fit import PrefillAdmissionFitGuard
from .prefill_source_hold import PrefillSourceHoldGuard
from .rejection_notice import RejectionNoticeGuard
from .transfer_checksum import TransferChecksumGuard
from .transfer_coverage import TransferCoverageGuard

# Guards sharing a target are wrapped in this order, each around the previous one, so
# the last listed runs first: before a commit, decode checks coverage (cheapest, names
# tokens and pages), then canaries (names unwritten pages), then the checksum.
GUARDS = [
    AdmissionDrainGuard,
    RejectionNoticeGuard,
    DecodeRejectionNoticeGuard,
    TransferChecksumGuard,
    DestinationCanaryGuard,
    TransferCoverageGuard,
    MooncakeBatchBoundGuard,
    PageGenerationGuard,  # inside prefill_source_hold on the shared free sinks: tags what is really freed
    PrefillSourceHoldGuard,
    DecodeDestinationHoldGuard,  # uses prefill_source_hold's free-sink diversion and chunk counts
    DecodeDeferredReleaseGuard,
    PrefillAdmissionFitGuard,
    DecodeAdmissionFitGuard,
    PoolCapacityGuard,
    HybridPoolCheckGuard,
    EmptyPromptGuard,
    FlushBarrierGuard,
    AbortBeforeArrivalGuard,
    AbortStateReleaseGuard,
    InputLimitMessageGuard,
]
