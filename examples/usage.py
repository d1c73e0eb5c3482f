"""One client's local rounds with three of the optimizers, on random data (a few seconds on a CPU)."""

import torch

import fedopt_kernels as fk

model = torch.nn.Linear(64, 10)
loss_fn = torch.nn.functional.cross_entropy
rounds, K = 3, 5  # FL rounds, local steps per round
local_batches = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(K)]  # the client's data

# FedDecaySGD: the learning rate decays within each round
feddecay = fk.FedDecaySGD(model.parameters(), lr=0.1, beta=0.9, momentum=0.9)  # lr_k = lr * beta ** k
for _ in range(rounds):
    # (a real client first loads the global model it received)
    feddecay.start_round()  # k = 0, momentum cleared (SCAFFOLD: correction=[...])
    for x, y in local_batches:
        feddecay.zero_grad()
        loss_fn(model(x), y).backward()
        feddecay.step()

# FedSAM: two gradients per step, as with any SAM optimizer
fedsam = fk.FedSAM(model.parameters(), lr=0.05, rho=0.05, momentum=0.9)
fedsam.start_round()


def sam_step(x, y):
    def closure():  # the loss and its gradient at the perturbed x + e
        fedsam.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    fedsam.zero_grad()
    loss_fn(model(x), y).backward()  # the first gradient, at x
    fedsam.step(closure)  # ascent to x + e, closure(), descent from x


for x, y in local_batches:
    sam_step(x, y)

# PAdaMFed: parameter-free step sizes; `gamma` is the server step size, used by your server
eta, gamma, beta = fk.theory_hparams(S=10, K=K, T=200)
padamfed = fk.PAdaMFed(model.parameters(), lr=eta, beta=beta)
zeros = [torch.zeros_like(p) for p in model.parameters()]
c, c_i, m = zeros, zeros, zeros  # the server's control and momentum, the client's control (round 0: zeros)
padamfed.start_round(global_control=c, local_control=c_i, momentum=m)
for x, y in local_batches:
    padamfed.zero_grad()
    loss_fn(model(x), y).backward()
    padamfed.step()
c_i = padamfed.local_control()  # the client's new control, sent to the server with its model

print(padamfed.resolved_backend())  # the backend step() uses for these parameters, e.g. "cpu"
print(fk.available_backends())  # available: reference, cpu  (+ why each other one is missing)
