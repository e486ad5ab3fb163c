"""Does torch.compile hand an autograd Function's backward the gradient of an output that an in-place op
made in its forward? (CPU; no codagen; docs/notes/compile.md, "Gradients under torch 2.11".)

``Slot.forward`` returns ``(2 x, slot)``; ``y + 3 slot`` has ``d/dx = 2 + 3 = 5``. Each way of making
``slot`` prints the eager and the compiled gradient (``backend="eager"``: Dynamo alone, no AOTAutograd).
torch 2.11 prints 2 for the in-place ones (the gradient of ``slot`` reaches backward as zeros); 2.13 prints 5.
"""
import torch

SLOTS = {
    "x.new_zeros(4)": lambda x: x.new_zeros(x.shape),
    "x.new_empty(4).zero_()": lambda x: x.new_empty(x.shape).zero_(),
    "torch.empty_like(x).fill_(0)": lambda x: torch.empty_like(x).fill_(0),
    "(x * 1).mul_(2)": lambda x: (x * 1).mul_(2),
}


def function_of(make_slot):
    class Slot(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, make_slot(x)

        @staticmethod
        def backward(ctx, grad_y, grad_slot):
            return grad_y * 2 + grad_slot

    def f(x):
        y, slot = Slot.apply(x)
        return y + 3 * slot
    return f


def main():
    x = torch.randn(4, requires_grad=True)
    for name, make_slot in SLOTS.items():
        f = function_of(make_slot)
        eager = torch.autograd.grad(f(x).sum(), x)[0]
        torch._dynamo.reset()
        compiled = torch.autograd.grad(torch.compile(f, backend="eager", fullgraph=True)(x).sum(), x)[0]
        print(f"torch {torch.__version__}  slot = {name:30s} eager {eager[0].item():+.1f}  compiled "
              f"{compiled[0].item():+.1f}")


if __name__ == "__main__":
    main()
