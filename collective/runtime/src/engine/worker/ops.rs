//! One collective per kind of operation (allreduce, broadcast, allgather, alltoall, reducescatter, barrier) for
//! one tensor, and the fused allreduce over a group's members, on the engine thread.

use super::{Pending, Stop, Worker, outcomes};
use crate::engine::request::{Input, Output, OutputBuffer, input_slice};
use crate::fused::FusedIo;
use crate::kernels::{elementwise, fill_identity, scale};
use crate::message::{OpKind, RequestMeta};
use crate::timeline::{EventName, Phase};
use hvd_collective::{Allgatherv, Alltoallv, DType, Reducescatter, StagedAllreduce};

impl Worker {
    pub(super) fn run_fused(&mut self, metas: &[RequestMeta]) -> Result<(), Stop> {
        if metas.len() == 1 && metas[0].splits.is_empty() {
            return self.run_single(&metas[0], &[], &[]);
        }
        let first = &metas[0];
        let (reduction, average) = elementwise(first.op);
        let post = first.postscale
            * if average {
                1.0 / self.topology.size as f64
            } else {
                1.0
            };
        let total: usize = metas.iter().map(|m| m.bytes()).sum();
        let lanes = self.lanes_of(metas);
        self.mark(&lanes, Phase::End, None); // QUEUE
        self.mark(
            &lanes,
            Phase::Begin,
            Some(EventName::Static("MEMCPY_IN_FUSION_BUFFER")),
        );
        let activity = self.activity(OpKind::Allreduce);
        // The members stay where they are: the transport reads them into its buffers and writes the result back
        // (`FusedIo`); results the engine owns get their buffers here.
        let mut owned: Vec<Option<Vec<u8>>> = vec![None; metas.len()];
        let mut io = FusedIo::new(first.dtype, reduction, post);
        let mut snapshot = false;
        for (m, slot) in metas.iter().zip(owned.iter_mut()) {
            let n = m.bytes();
            let Some(p) = self.pending.get(&m.name) else {
                // A joined rank's missing member: the reduction's identity in, nothing out.
                io.input(std::ptr::null(), n, 1.0);
                io.output(std::ptr::null_mut(), n);
                continue;
            };
            match &p.request.input {
                Input::Gather(parts, aliased) => {
                    for &(ptr, len) in parts {
                        io.input(ptr, len, m.prescale);
                    }
                    snapshot |= *aliased;
                }
                input => {
                    let s = input_slice(input);
                    io.input(s.as_ptr(), s.len(), m.prescale);
                }
            }
            match &p.request.output {
                OutputBuffer::Raw(ptr, len) => io.output(*ptr, *len),
                OutputBuffer::Scatter(parts) => {
                    for &(ptr, len) in parts {
                        io.output(ptr, len);
                    }
                }
                OutputBuffer::Engine => {
                    let buf = slot.insert(vec![0u8; n]);
                    io.output(buf.as_mut_ptr(), n);
                }
            }
        }
        if snapshot {
            io.snapshot_inputs();
        }
        if let Some(t) = &mut self.timeline {
            io.phases(t, lanes.clone(), activity);
        }
        let result = self.transport.allreduce_staged(StagedAllreduce {
            len: total,
            dtype: first.dtype,
            op: reduction,
            io: &mut io,
            scratch: &mut self.fusion,
        });
        io.finish();
        self.mark(&lanes, Phase::End, None); // the operation
        result?;
        let mut done = Vec::with_capacity(metas.len());
        for (m, slot) in metas.iter().zip(owned) {
            if let Some(p) = self.pending.remove(&m.name) {
                let shape = if p.members.is_none() {
                    m.shape.clone()
                } else {
                    Vec::new()
                };
                done.push((
                    p,
                    Output {
                        data: slot.unwrap_or_default(),
                        shape,
                        ..Output::default()
                    },
                ));
            }
        }
        self.complete_many(
            done.into_iter()
                .flat_map(|(p, out)| outcomes(p.handle, p.members, Ok(out))),
        );
        Ok(())
    }

    pub(super) fn run_single(
        &mut self,
        meta: &RequestMeta,
        dim0s: &[i64],
        splits: &[i64],
    ) -> Result<(), Stop> {
        let lanes = self.lanes_of([meta]);
        self.mark(&lanes, Phase::End, None); // QUEUE
        let activity = self.activity(meta.kind);
        self.mark(&lanes, Phase::Begin, Some(activity));
        let mut p = self.pending.remove(&meta.name);
        let result = self.collective(meta, p.as_mut(), dim0s, splits);
        self.mark(&lanes, Phase::End, None);
        self.mark(&lanes, Phase::End, None);
        let out = match result {
            Ok(out) => out,
            Err(stop) => {
                // Back among the pending, so that stopping the engine fails its handle: dropped here, its waiter
                // would wait forever (a survivor of a lost peer hung in `synchronize`).
                if let Some(p) = p {
                    self.pending.insert(meta.name.clone(), p);
                }
                return Err(stop);
            }
        };
        if let Some(p) = p {
            self.complete(p.handle, Ok(out));
        }
        Ok(())
    }

    /// One collective for one tensor; `p` is None on a joined rank, which contributes no data.
    fn collective(
        &mut self,
        meta: &RequestMeta,
        p: Option<&mut Pending>,
        dim0s: &[i64],
        splits: &[i64],
    ) -> Result<Output, Stop> {
        let size = self.topology.size;
        let me = self.topology.rank;
        let esize = meta.dtype.size();
        let row_bytes = meta.row_elements() * esize;
        let mut out = Output {
            shape: meta.shape.clone(),
            ..Output::default()
        };
        let (reduction, average) = elementwise(meta.op);
        let t = &mut self.transport;
        match meta.kind {
            OpKind::Allreduce | OpKind::Broadcast => {
                let n = meta.bytes();
                let mut scratch = Vec::new();
                let buf: &mut [u8] = match p {
                    Some(p) => {
                        let input = input_slice(&p.request.input);
                        let (ptr, len) = match &mut p.request.output {
                            OutputBuffer::Raw(ptr, len) => (*ptr, *len),
                            OutputBuffer::Engine => {
                                out.data = vec![0u8; n];
                                (out.data.as_mut_ptr(), n)
                            }
                            // `plan` sends every fused group through `run_fused`.
                            OutputBuffer::Scatter(_) => {
                                return Err(Stop::Internal(format!(
                                    "tensor group `{}` reached the single-tensor path",
                                    meta.name
                                )));
                            }
                        };
                        let buf: &mut [u8] = if len == 0 {
                            &mut [] // (an empty tensor's data pointer may be null)
                        } else {
                            // SAFETY: caller memory validated to be `len` bytes and live until completion, or our
                            // Vec.
                            unsafe { std::slice::from_raw_parts_mut(ptr, len) }
                        };
                        if !std::ptr::eq(input.as_ptr(), buf.as_ptr()) {
                            buf.copy_from_slice(input);
                        }
                        if meta.kind == OpKind::Allreduce {
                            scale(buf, meta.dtype, meta.prescale);
                        }
                        buf
                    }
                    None => {
                        scratch.resize(n, 0);
                        if meta.kind == OpKind::Allreduce {
                            fill_identity(&mut scratch, meta.dtype, reduction);
                        }
                        &mut scratch
                    }
                };
                if meta.kind == OpKind::Allreduce {
                    t.allreduce_in_place(buf, meta.dtype, reduction)?;
                    let post = meta.postscale * if average { 1.0 / size as f64 } else { 1.0 };
                    scale(buf, meta.dtype, post);
                } else {
                    t.broadcast(buf, DType::U8, meta.root as usize)?;
                }
            }
            OpKind::Allgather => {
                let counts: Vec<usize> = dim0s.iter().map(|d| *d as usize * row_bytes).collect();
                let mut recv = vec![0u8; counts.iter().sum()];
                let send = p.map(|p| input_slice(&p.request.input)).unwrap_or(&[]);
                t.allgatherv(Allgatherv {
                    send,
                    recv: &mut recv,
                    counts: &counts,
                    dtype: DType::U8,
                })?;
                out.data = recv;
                out.shape[0] = dim0s.iter().sum();
            }
            OpKind::Alltoall => {
                if splits.len() != size * size {
                    return Err(Stop::Internal(format!(
                        "alltoall of `{}`: the coordinator sent {} split counts for {size} ranks",
                        meta.name,
                        splits.len()
                    )));
                }
                // A joined rank (no `p`) sends nothing: the coordinator gave it zero splits.
                let send_counts: Vec<usize> = (0..size)
                    .map(|s| splits[me * size + s] as usize * row_bytes)
                    .collect();
                let recv_rows: Vec<i64> = (0..size).map(|s| splits[s * size + me]).collect();
                let recv_counts: Vec<usize> =
                    recv_rows.iter().map(|r| *r as usize * row_bytes).collect();
                let mut recv = vec![0u8; recv_counts.iter().sum()];
                let send = p.map(|p| input_slice(&p.request.input)).unwrap_or(&[]);
                t.alltoallv(Alltoallv {
                    send,
                    send_counts: &send_counts,
                    recv: &mut recv,
                    recv_counts: &recv_counts,
                    dtype: DType::U8,
                })?;
                out.data = recv;
                out.shape[0] = recv_rows.iter().sum();
                out.splits = recv_rows;
            }
            OpKind::Reducescatter => {
                let dim0 = meta.dim0() as usize;
                let rows: Vec<usize> = (0..size)
                    .map(|r| dim0 / size + usize::from(r < dim0 % size))
                    .collect();
                let blocks: Vec<usize> = rows.iter().map(|r| r * meta.row_elements()).collect();
                let mut buf = vec![0u8; meta.bytes()];
                match p {
                    Some(p) => {
                        buf.copy_from_slice(input_slice(&p.request.input));
                        scale(&mut buf, meta.dtype, meta.prescale);
                    }
                    None => fill_identity(&mut buf, meta.dtype, reduction),
                }
                let mut mine = vec![0u8; blocks[me] * esize];
                t.reducescatter(Reducescatter {
                    send: &buf,
                    recv: &mut mine,
                    counts: &blocks,
                    dtype: meta.dtype,
                    op: reduction,
                })?;
                let post = meta.postscale * if average { 1.0 / size as f64 } else { 1.0 };
                scale(&mut mine, meta.dtype, post);
                out.data = mine;
                if out.shape.is_empty() {
                    out.shape = vec![rows[me] as i64];
                } else {
                    out.shape[0] = rows[me] as i64;
                }
            }
            OpKind::Barrier => t.barrier()?,
            OpKind::Join => {}
        }
        Ok(out)
    }
}
