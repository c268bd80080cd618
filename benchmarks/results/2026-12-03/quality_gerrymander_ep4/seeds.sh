cd /work/main
for s in 1 2 3; do
  .venv/bin/moeforge train configs/quality_small.yaml --nproc-per-node 4 --parallel.ep=4 --train.micro_batch_size=4 --train.max_steps=300 \
    --model.moe.aux_loss_coef=0.001 --model.moe.bias_update_rate=0 --train.seed=$s --train.run_dir=runs/exp/gm_seeds/weak-aux-seed$s --logging.progress=false > /tmp/gm/seed$s.log 2>&1
  echo "seed $s rc $?" >> /tmp/gm/seeds.done
done
