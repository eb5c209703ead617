//! Measuring tools of the CUDA backend: events between the step's kernel groups (eager), and
//! the CTA timeline (`DV2_CTA_TIMELINE=1`).

use cudarc::driver::CudaEvent;

use super::device::{driver_error, Gpu};
use super::step::CudaBackend;
use crate::backend::Backend;
use crate::error::{Error, Result};

/// Events recorded between kernel groups of one step.
pub struct StageMarks {
    start: CudaEvent,
    marks: Vec<(&'static str, CudaEvent)>,
}

impl StageMarks {
    fn new(gpu: &Gpu) -> Result<Self> {
        let start = timing_event(gpu)?;
        start
            .record(&gpu.stream)
            .map_err(driver_error("event record"))?;
        Ok(Self {
            start,
            marks: Vec::new(),
        })
    }

    pub(super) fn record(&mut self, gpu: &Gpu, label: &'static str) -> Result<()> {
        let e = timing_event(gpu)?;
        e.record(&gpu.stream)
            .map_err(driver_error("event record"))?;
        self.marks.push((label, e));
        Ok(())
    }

    fn totals(&self) -> Result<Vec<(&'static str, f64)>> {
        let mut out: Vec<(&'static str, f64)> = Vec::new();
        let mut prev = &self.start;
        for (label, e) in &self.marks {
            let ms = prev.elapsed_ms(e).map_err(driver_error("event elapsed"))? as f64;
            match out.iter_mut().find(|(l, _)| l == label) {
                Some((_, t)) => *t += ms,
                None => out.push((label, ms)),
            }
            prev = e;
        }
        Ok(out)
    }
}

/// An event that records time (cudarc's default disables timing).
pub fn timing_event(gpu: &Gpu) -> Result<CudaEvent> {
    gpu.ctx
        .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(driver_error("event create"))
}

impl CudaBackend {
    /// `DV2_CTA_TIMELINE=1` at load (kernels/common.cuh, CTA_TIMELINE): runs `steps` decode steps
    /// as [`Backend::step_n`] does, the recording on for the last, and returns its records:
    /// [grid id, kind << 56 | SM << 48 | CTAs << 24 | CTA, t0, t1] in globaltimer ns, kind 0 a
    /// CTA's PDL wait (t0 before it, t1 after), kind 1 a GEMV or attention CTA's end (t0), kind 2
    /// its start (t0).
    pub fn cta_timeline(&mut self, steps: usize) -> Result<Vec<[u64; 4]>> {
        if !self.ops.cfg.cta_timeline {
            return Err(Error::Unsupported(
                "the CTA timeline needs DV2_CTA_TIMELINE=1 when the backend loads".into(),
            ));
        }
        let mut out = vec![0u32; steps.saturating_sub(1)];
        self.step_n(&mut out)?;
        let stream = self.ops.gpu.stream.clone();
        let module = self.ops.k.module.clone();
        let global = |name: &str| {
            module
                .get_global(name, &stream)
                .map_err(driver_error("timeline global"))
        };
        stream
            .memcpy_htod(&[0u8; 4], &mut global("dv2_timeline_n")?)
            .map_err(driver_error("timeline reset"))?;
        self.step_n(&mut [0u32])?;
        let mut n = [0u8; 4];
        stream
            .memcpy_dtoh(&global("dv2_timeline_n")?, &mut n)
            .map_err(driver_error("timeline count"))?;
        let records = global("dv2_timeline")?;
        let mut bytes = vec![0u8; records.len()];
        stream
            .memcpy_dtoh(&records, &mut bytes)
            .map_err(driver_error("timeline records"))?;
        self.ops.gpu.sync()?;
        let (n, room) = (u32::from_le_bytes(n) as usize, bytes.len() / 32);
        if n > room {
            return Err(Error::Unsupported(format!(
                "the CTA timeline holds {room} records, the step wrote {n} \
                 (kernels/common.cuh, CTA_TIMELINE_RECORDS)"
            )));
        }
        Ok(bytes[..32 * n]
            .chunks_exact(32)
            .map(|r| {
                std::array::from_fn(|i| u64::from_le_bytes(r[8 * i..8 * i + 8].try_into().unwrap()))
            })
            .collect())
    }

    /// Runs one eager greedy step with an event after each kernel group; returns the time of
    /// each stage summed over layers, in ms, in first-seen order. Advances the state like
    /// step().
    pub fn profile_step(&mut self) -> Result<Vec<(&'static str, f64)>> {
        self.position = None; // the commit below moves it on (or not, past EOS)
        self.settled = None;
        let mut marks = StageMarks::new(&self.ops.gpu)?;
        self.forward_marked(true, false, &mut Some(&mut marks))?;
        self.commit(self.eos)?;
        marks.record(&self.ops.gpu, "commit")?;
        self.ops.gpu.sync()?;
        marks.totals()
    }
}
