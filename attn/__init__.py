"""attnlab attention: registry, masks, references and fused kernels of every variant."""

from attn.families import FAMILIES, Family, family_of  # noqa: F401
from attn.families.layer_extras import LayerExtras, LayerShape  # noqa: F401
from attn.masks import MaskSpec, SegmentMask, dense_mask, segment_bounds, segments, visible_key_counts  # noqa: F401
from attn.ops import BACKENDS, AttentionCall, attention, pin_kernel_configs, preload_kernel, resolve_backend
from attn.reference import attention_weights, exact_zero_fraction, reference_attention
from attn.registry import VARIANTS, Variant, check_layer_options, get_variant, layer_option_values, variant_names
from attn.specs import SigmoidFamilySpec, SoftmaxFamilySpec, ThresholdFamilySpec
from attn.validation import check_inputs

