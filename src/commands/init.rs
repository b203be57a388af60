//! `hvd init`: write a starter `train.hvd` and `train.py` that pass `hvd check`.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct InitArgs {
    /// The project directory (created if missing).
    #[arg(default_value = ".")]
    pub dir: PathBuf,

    /// Which framework the starter uses.
    #[arg(long, value_enum, default_value_t = Template::Numpy)]
    pub template: Template,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Template {
    /// numpy only: a data-parallel linear regression; no framework to install.
    Numpy,
    /// PyTorch (CPU wheels), with the hvd runtime for collectives.
    Pytorch,
    /// TensorFlow (CPU) with Horovod 0.28.1 built from source against it.
    Tensorflow,
}

pub fn run(args: InitArgs) -> CommandResult {
    let hvd_path = args.dir.join("train.hvd");
    let py_path = args.dir.join("train.py");
    // Check both before writing either: never leave a half-initialized project.
    for path in [&hvd_path, &py_path] {
        if path.exists() {
            return Err(Failure::new(
                Status::Usage,
                miette::miette!(
                    help = "choose another directory, or move the file away first",
                    "{} already exists; `hvd init` does not overwrite files",
                    path.display()
                ),
            ));
        }
    }
    let io = |path: &Path, e: std::io::Error| {
        Failure::from_error_in(
            Status::Failure,
            format_args!("failed to write {}", path.display()),
            &e,
        )
    };
    std::fs::create_dir_all(&args.dir).map_err(|e| io(&args.dir, e))?;
    let name = project_name(&args.dir);
    let (hvd, py) = match args.template {
        Template::Numpy => (NUMPY_HVD, NUMPY_PY),
        Template::Pytorch => (PYTORCH_HVD, PYTORCH_PY),
        Template::Tensorflow => (TENSORFLOW_HVD, TENSORFLOW_PY),
    };
    write_new(&hvd_path, &hvd.render(&name)).map_err(|e| io(&hvd_path, e))?;
    write_new(&py_path, py).map_err(|e| io(&py_path, e))?;
    println!("wrote {} and {}", hvd_path.display(), py_path.display());
    println!("next: hvd check {}", hvd_path.display());
    Ok(Status::Success)
}

/// Create a file that must not exist yet (`create_new`: no race with another writer).
fn write_new(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    file.write_all(text.as_bytes())
}

/// The directory's name, reduced to characters that read well in `project "..."`.
fn project_name(dir: &Path) -> String {
    let base = std::fs::canonicalize(dir)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    let cleaned: String = base
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    if cleaned.trim_matches('-').is_empty() {
        "train".into()
    } else {
        cleaned
    }
}

/// A starter `train.hvd`: the common header and `train` step around a template's own `let`s (`\n`-framed, or
/// empty), env fields, resources and step timeout.
struct TrainHvd {
    lets: &'static str,
    env: &'static str,
    resources: &'static str,
    timeout: &'static str,
}

impl TrainHvd {
    fn render(&self, name: &str) -> String {
        let TrainHvd {
            lets,
            env,
            resources,
            timeout,
        } = self;
        format!(
            "# Written by `hvd init`. Check it with `hvd check train.hvd`; see docs/language.md.\n\
             project \"{name}\"\nimport std\n{lets}\nenv {{\n{env}}}\n\nresources {{ {resources} }}\n\n\
             step train {{\n  workers = 2\n  run     = \"python train.py\"\n  timeout = {timeout}\n}}\n"
        )
    }
}

const NUMPY_HVD: TrainHvd = TrainHvd {
    lets: "",
    env: r#"  python   = "3.11"
  packages = ["numpy<2"]
"#,
    resources: "cpus = 1, mem = 1GiB",
    timeout: "10m",
};

const PYTORCH_HVD: TrainHvd = TrainHvd {
    lets: "\nlet torch = std.torch { version = \"2.3.1\" }\n",
    env: r#"  python   = "3.11"
  packages = [torch, "numpy<2"]
"#,
    resources: "cpus = 2, mem = 4GiB",
    timeout: "30m",
};

const TENSORFLOW_HVD: TrainHvd = TrainHvd {
    lets: "\nlet tf = std.tensorflow { version = \"2.12.1\", variant = \"cpu\" }\n",
    env: r#"  python    = "3.11"
  toolchain = std.gcc { version = "12" }
  packages  = [
    tf,
    std.horovod { version = "0.28.1", frameworks = [tf] }, # built from source against tf
    "numpy<2",
  ]
"#,
    resources: "cpus = 2, mem = 4GiB",
    timeout: "1h",
};

const NUMPY_PY: &str = r#""""Starter script from `hvd init`: data-parallel linear regression with numpy.

Each worker fits on its own shard of synthetic data; gradients are averaged across workers with the `hvd`
runtime, which every env built by hvd contains. Run alone (outside `hvd run`), it is one worker of one.
"""
import numpy as np

import hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()

rng = np.random.default_rng(0)
true_w = np.array([2.0, -3.0, 0.5])
x = rng.normal(size=(4096, 3))
y = x @ true_w + 0.01 * rng.normal(size=4096)
x, y = x[rank::size], y[rank::size]

w = np.zeros(3)
for epoch in range(200):
    grad = 2.0 * x.T @ (x @ w - y) / len(y)
    w -= 0.1 * hvd.allreduce(grad, op=hvd.Average, name="grad")

loss = float(hvd.allreduce(np.array([np.mean((x @ w - y) ** 2)]), op=hvd.Average, name="loss")[0])
if rank == 0:
    print(f"{size} worker(s): w={np.round(w, 3).tolist()} loss={loss:.5f}")
hvd.shutdown()
"#;

const PYTORCH_PY: &str = r#""""Starter script from `hvd init`: data-parallel training of a small model with PyTorch.

Gradients are averaged across workers by `hvd.torch.DistributedOptimizer`, over the `hvd` runtime that every
env built by hvd contains. Run alone (outside `hvd run`), it is one worker of one.
"""
import torch

import hvd
import hvd.torch

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(0)

model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
hvd.torch.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.torch.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

x = torch.randn(2048, 8)
y = x.sum(dim=1, keepdim=True)
x, y = x[rank::size], y[rank::size]

for epoch in range(100):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()

print(f"rank {rank}/{size}: loss={loss.item():.5f}")
hvd.shutdown()
"#;

const TENSORFLOW_PY: &str = r#""""Starter script from `hvd init`: data-parallel Keras training with Horovod over TensorFlow.

`hvd run` starts the workers with Horovod's gloo variables set, so no mpirun is needed.
"""
import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd

hvd.init()
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(2048, 8)).astype("float32")
y = x.sum(axis=1, keepdims=True)

model = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="relu"), tf.keras.layers.Dense(1)])
optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size()))
model.compile(optimizer=optimizer, loss="mse")
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
history = model.fit(x, y, batch_size=64, epochs=5, callbacks=callbacks, verbose=0)
print(f"rank {hvd.rank()}/{hvd.size()}: loss={history.history['loss'][-1]:.5f}")
"#;
