#!/bin/sh
# hvd: slurm engine outside an allocation: `hvd run` submits these batch scripts and follows them; `sh` this to submit them by hand
set -e
mkdir -p @DIR@/.hvd/slurm

JOB_PREP=$(sbatch --parsable --kill-on-invalid-dep=yes <<'HVD_BATCH_SCRIPT_END'
#!/bin/sh
#SBATCH --job-name=t-prep
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --gpus-per-task=1
#SBATCH --mem=1024M
#SBATCH --partition=debug
#SBATCH --output=@DIR@/.hvd/slurm/t-prep-%j.out
#SBATCH --error=@DIR@/.hvd/slurm/t-prep-%j.err
set -e
cd @DIR@
export PYTHONUNBUFFERED=1
export HVD_GPUS_PER_WORKER=1
/bin/sh -c 'echo prep'
HVD_BATCH_SCRIPT_END
)

JOB_TRAIN=$(sbatch --parsable --kill-on-invalid-dep=yes --dependency=afterok:${JOB_PREP} <<'HVD_BATCH_SCRIPT_END'
#!/bin/sh
#SBATCH --job-name=t-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=2
#SBATCH --gpus-per-task=1
#SBATCH --mem=2048M
#SBATCH --partition=debug
#SBATCH --output=@DIR@/.hvd/slurm/t-train-%j.out
#SBATCH --error=@DIR@/.hvd/slurm/t-train-%j.err
set -e
cd @DIR@
export PYTHONUNBUFFERED=1
export HVD_GPUS_PER_WORKER=1
export LR=0.1
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 12000))
rdv=@DIR@/.hvd/slurm/rdv-"$SLURM_JOB_ID"
status=0
srun --kill-on-bad-exit=1 --ntasks=4 --label --cpus-per-task=2 --gpus-per-task=1 @HVD@ worker-env -- env "HVD_RENDEZVOUS=file:$rdv" /bin/sh -c 'python train.py' || status=$?
rm -rf "$rdv"
exit "$status"
HVD_BATCH_SCRIPT_END
)
