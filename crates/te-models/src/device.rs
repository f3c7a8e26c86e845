//! The device ops the transformer layer ([`crate::layer`]) and the model
//! forward ([`crate::model`]) are written against, once for every device.
//!
//! A device names its activation buffer ([`DeviceOps::Buf`]: f32 values,
//! row-major, `[rows, width]`), its weight matrix and vector types and its
//! RoPE table, and implements each op on them. [`Cpu`] is the host: every
//! op calls the function the CPU forward has always called
//! ([`crate::ops`]; te-kernels' `norm`, [`te_kernels::activation`] and
//! `apply_rope_cpu`),
//! in the same order as the CPU forward before device ops existed. The CUDA device
//! is `crate::cuda::Cuda` (bf16 weights, f32 activations).
//!
//! KV save and attention are not ops here: they need the step's cache, so
//! the caller of the layer passes them in as its `attend` closure (single
//! rank, context parallel, CUDA).

use te_attention::AttentionWorkspace;
use te_kernels::rope::{apply_rope_cpu, RopeArgs, RopeTable};

use crate::config::Activation;
use te_kernels::activation::gated_act_inplace;
use te_kernels::norm::{add_inplace, rms_norm_inplace, rms_norm_into};

use crate::ops::Linear;
use crate::{ModelError, Result};

/// The ops of one device. Every buffer argument holds f32 values in the
/// shape the op names; an op's output buffer has been sized with
/// [`resize`](Self::resize). Ops may run asynchronously (CUDA: on the
/// device's stream); errors name the op.
pub trait DeviceOps {
    /// An f32 activation buffer (host `Vec<f32>`, device memory).
    type Buf;
    /// A `[out_features, in_features]` weight matrix with optional bias.
    type Linear;
    /// A weight vector (norm multipliers, already `1 + w` for Gemma).
    type Vector;
    /// A RoPE table `[max_positions, d/2]` (cos, sin).
    type Rope;

    /// The number of values `buf` holds.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Makes `buf` hold exactly `len` values (contents unspecified).
    fn resize(&mut self, buf: &mut Self::Buf, len: usize) -> Result<()>;
    /// `y: [t, out] = x: [t, in] · Wᵀ (+ bias)`.
    fn linear(
        &mut self,
        w: &Self::Linear,
        x: &Self::Buf,
        t: usize,
        y: &mut Self::Buf,
    ) -> Result<()>;
    /// [`linear`](Self::linear) of `N` matrices on the same `x` (a layer's
    /// Q, K and V, or its gate and up projections): `ys[i]: [t, out_i] =
    /// x · ws[i]ᵀ (+ bias)`, each exactly as `linear` computes it. The CPU
    /// runs them as one parallel launch; by default they run one by one.
    fn linear_many<const N: usize>(
        &mut self,
        ws: [&Self::Linear; N],
        x: &Self::Buf,
        t: usize,
        ys: [&mut Self::Buf; N],
    ) -> Result<()> {
        for (w, y) in ws.into_iter().zip(ys) {
            self.linear(w, x, t, y)?;
        }
        Ok(())
    }
    /// `y = RMSNorm(x) * w` over rows of `w`'s length (`x`, `y` same shape).
    fn rms_norm_into(
        &mut self,
        x: &Self::Buf,
        w: &Self::Vector,
        eps: f32,
        y: &mut Self::Buf,
    ) -> Result<()>;
    /// [`rms_norm_into`](Self::rms_norm_into) in place (also the q/k head
    /// norms: rows of `d` values).
    fn rms_norm_inplace(&mut self, x: &mut Self::Buf, w: &Self::Vector, eps: f32) -> Result<()>;
    /// RoPE in place on `x` laid out as `args` says (thd here).
    fn rope(&mut self, x: &mut Self::Buf, table: &Self::Rope, args: &RopeArgs) -> Result<()>;
    /// `g = act(g) * u`, elementwise (SiLU or GELU-tanh).
    fn gated_act(&mut self, act: Activation, g: &mut Self::Buf, u: &Self::Buf) -> Result<()>;
    /// `x = x + y`, elementwise.
    fn add_inplace(&mut self, x: &mut Self::Buf, y: &Self::Buf) -> Result<()>;
    /// `x: [t, hidden]` = rows `tokens: [t]` of the embedding `table`
    /// (`[vocab, hidden]`), times `scale`. Token ids were checked against
    /// the vocabulary by the caller.
    fn embed(
        &mut self,
        table: &Self::Linear,
        tokens: &[u32],
        scale: f32,
        x: &mut Self::Buf,
    ) -> Result<()>;
    /// `out: [rows.len(), width]` = rows `rows` of `x: [.., width]`.
    fn gather_rows(
        &mut self,
        x: &Self::Buf,
        rows: &[usize],
        width: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// `x = cap * tanh(x / cap)`, elementwise (final logit softcap).
    fn softcap(&mut self, x: &mut Self::Buf, cap: f32) -> Result<()>;
}

/// The host device: today's CPU code, with the buffers it reuses (the
/// matrix-vector scratch and attention's workspace).
#[derive(Default)]
pub struct Cpu {
    pub(crate) scratch: te_kernels::matmul::Scratch,
    pub(crate) attention: AttentionWorkspace,
}

impl DeviceOps for Cpu {
    type Buf = Vec<f32>;
    type Linear = Linear;
    type Vector = Vec<f32>;
    type Rope = RopeTable;

    fn resize(&mut self, buf: &mut Vec<f32>, len: usize) -> Result<()> {
        buf.resize(len, 0.0);
        Ok(())
    }

    fn linear(&mut self, w: &Linear, x: &Vec<f32>, t: usize, y: &mut Vec<f32>) -> Result<()> {
        w.forward_into(x, t, y, &mut self.scratch);
        Ok(())
    }

    fn linear_many<const N: usize>(
        &mut self,
        ws: [&Linear; N],
        x: &Vec<f32>,
        t: usize,
        ys: [&mut Vec<f32>; N],
    ) -> Result<()> {
        Linear::forward_many_into(ws, x, t, ys.map(|y| &mut y[..]), &mut self.scratch);
        Ok(())
    }

    fn rms_norm_into(
        &mut self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        eps: f32,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        rms_norm_into(x, w, eps, y);
        Ok(())
    }

    fn rms_norm_inplace(&mut self, x: &mut Vec<f32>, w: &Vec<f32>, eps: f32) -> Result<()> {
        rms_norm_inplace(x, w, eps);
        Ok(())
    }

    fn rope(&mut self, x: &mut Vec<f32>, table: &RopeTable, args: &RopeArgs) -> Result<()> {
        apply_rope_cpu(x, table, args)?;
        Ok(())
    }

    fn gated_act(&mut self, act: Activation, g: &mut Vec<f32>, u: &Vec<f32>) -> Result<()> {
        gated_act_inplace(act, g, u);
        Ok(())
    }

    fn add_inplace(&mut self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<()> {
        add_inplace(x, y);
        Ok(())
    }

    fn embed(
        &mut self,
        table: &Linear,
        tokens: &[u32],
        scale: f32,
        x: &mut Vec<f32>,
    ) -> Result<()> {
        embed_rows(table, tokens, scale, x);
        Ok(())
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn gather_rows(
        &mut self,
        x: &Vec<f32>,
        rows: &[usize],
        width: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        for (dst, &r) in out.chunks_exact_mut(width).zip(rows) {
            dst.copy_from_slice(&x[r * width..(r + 1) * width]);
        }
        Ok(())
    }

    fn softcap(&mut self, x: &mut Vec<f32>, cap: f32) -> Result<()> {
        x.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
        Ok(())
    }
}

/// Checks `tokens` against a vocabulary of `vocab` ids (before any device
/// op runs).
pub(crate) fn check_tokens(tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(tok) => Err(ModelError::TokenOutOfVocabulary {
            token: *tok,
            vocab_size: vocab,
        }),
        None => Ok(()),
    }
}

/// `x: [t, hidden]` = rows `tokens` of `table: [vocab, hidden]` (ids
/// checked) times `scale`, on the host.
pub(crate) fn embed_rows(table: &Linear, tokens: &[u32], scale: f32, x: &mut [f32]) {
    let hidden = table.in_features;
    for (&tok, row) in tokens.iter().zip(x.chunks_exact_mut(hidden)) {
        table.row_into(tok as usize, row);
        row.iter_mut().for_each(|v| *v *= scale);
    }
}
