#!/bin/sh
# hvd: slurm engine outside an allocation: `sh` this to submit every step (hvd does not submit yet)
set -e

JOB_PREP=$(sbatch --parsable <<'EOF'
#!/bin/sh
#SBATCH --job-name=t-prep
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --gpus-per-task=1
#SBATCH --mem=1024M
#SBATCH --partition=debug
#SBATCH --output=t-prep-%j.out
set -e
cd @DIR@
/bin/sh -c 'echo prep'
EOF
)

JOB_TRAIN=$(sbatch --parsable --dependency=afterok:${JOB_PREP} <<'EOF'
#!/bin/sh
#SBATCH --job-name=t-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=2
#SBATCH --gpus-per-task=1
#SBATCH --mem=2048M
#SBATCH --partition=debug
#SBATCH --output=t-train-%j.out
set -e
cd @DIR@
export LR=0.1
srun --kill-on-bad-exit=1 --ntasks=4 --label --cpus-per-task=2 --gpus-per-task=1 @HVD@ worker-env -- /bin/sh -c 'python train.py'
EOF
)
