"""The op names the forward's recorder (:mod:`.recorder`) sorts calls by: lists, where no property of an op
tells one kind of call from another (each list says why it is one)."""

# Ops that pass a tensor's values on unchanged (casts, copies, dropout at eval): a view of a parameter stays one.
# (A list because no property of an op tells a cast from an elementwise function of the weight.)
SAME = {"to", "type", "float", "half", "bfloat16", "double", "detach", "requires_grad_", "cpu", "cuda",
        "contiguous", "clone", "dropout", "alpha_dropout", "feature_alpha_dropout"}
# Sums and products of two tensors' elements.
LINEAR_BIN = {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__", "sub_"}
PRODUCT_BIN = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__rtruediv__", "__itruediv__",
               "div_", "true_divide"}
# Ops that combine several inputs' elements arithmetically: weights' outputs summed or multiplied together (a
# residual stream, attention scores) are no single weight's output any more.  (A list: an op's signature does
# not tell a sum of two streams from a choice between them, as ``where`` or ``cat`` make.)
MIXING = LINEAR_BIN | PRODUCT_BIN | {"addcmul", "addcdiv", "lerp", "matmul", "__matmul__", "__rmatmul__", "bmm",
                                    "mm", "baddbmm", "addmm", "einsum", "scaled_dot_product_attention", "linear"}
# Ops that return a view where the strides allow and a copy otherwise (``reshape`` after a ``permute``): the copy
# rearranges the elements as the view would, so an output's feature companion follows it all the same.
RESHAPES = {"reshape", "reshape_as", "flatten"}
PIECES = {"chunk", "split", "unbind", "tensor_split", "split_with_sizes", "__getitem__", "narrow", "select"}
# Copies that rearrange a parameter's elements (a learned query table repeated per batch): still the weight where a
# matrix op applies it, its layout unknown.  (A list: no property of an op tells a rearrangement from a function.)
COPIES = {"repeat", "tile", "repeat_interleave", "index_select", "gather", "take", "take_along_dim", "flip", "roll"}
UNARY = {"neg", "__neg__", "silu", "gelu", "relu", "sigmoid", "tanh", "softplus", "exp", "clamp", "clip", "abs",
         "leaky_relu", "elu", "mish", "hardswish", "hardsigmoid", "relu6", "square", "sqrt", "rsqrt", "log",
         "sin", "cos", "pow", "__pow__", "silu_", "relu_", "gelu_", "sigmoid_", "tanh_", "clamp_", "float_power"}
CAT = {"cat", "concat", "concatenate", "stack"}
# torch.nn.functional's losses, each with how many leading arguments are predictions (the rest: targets, weights).
# What a loss reads is an end of the forward as much as what it returns: a model that returns ``loss + aux`` (a
# load-balancing term) returns a sum no single weight produced, but its loss still read the head's output.
# (A list: nothing in an op's signature says that it compares a prediction with a target.)
LOSSES = {"cross_entropy": 1, "nll_loss": 1, "binary_cross_entropy": 1, "binary_cross_entropy_with_logits": 1,
          "mse_loss": 1, "l1_loss": 1, "smooth_l1_loss": 1, "huber_loss": 1, "kl_div": 1, "poisson_nll_loss": 1,
          "gaussian_nll_loss": 1, "soft_margin_loss": 1, "multilabel_soft_margin_loss": 1, "multi_margin_loss": 1,
          "multilabel_margin_loss": 1, "hinge_embedding_loss": 1, "ctc_loss": 1, "cosine_embedding_loss": 2,
          "margin_ranking_loss": 2, "triplet_margin_loss": 3, "triplet_margin_with_distance_loss": 3}
POOLS = {"mean", "sum", "amax", "amin", "logsumexp", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
         "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
         "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices"}
