//! A write-only 16550-style console on COM1: the guest's bytes become lines.
//!
//! The guest only writes the data register; reads of the other registers say
//! "transmitter empty" so a polling driver would not wait forever.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::guest_abi::PORT_SERIAL;

/// Where finished console lines go.
pub type ConsoleSink = Arc<dyn Fn(&str) + Send + Sync>;

/// Lines kept for reports (a panic message, tests).
const KEPT_LINES: usize = 256;
/// A line longer than this is cut, so a guest cannot grow host memory.
const MAX_LINE: usize = 4096;
/// Line status register: transmitter holding register and shift register empty.
const LSR_TX_EMPTY: u8 = 0x60;

#[derive(Default)]
struct State {
    line: Vec<u8>,
    kept: VecDeque<String>,
}

/// The console device.
pub struct Serial {
    state: Mutex<State>,
    sink: Option<ConsoleSink>,
}

impl Serial {
    /// A console that hands each finished line to `sink` (if any) and keeps the last ones.
    pub fn new(sink: Option<ConsoleSink>) -> Self {
        Serial {
            state: Mutex::default(),
            sink,
        }
    }

    /// True for the eight ports of COM1.
    pub fn owns(port: u16) -> bool {
        (PORT_SERIAL..PORT_SERIAL + 8).contains(&port)
    }

    /// A guest write to one of the ports.
    pub fn write(&self, port: u16, data: &[u8]) {
        if port != PORT_SERIAL {
            return; // configuration registers: nothing to configure
        }
        let mut done = Vec::new();
        {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            for &b in data {
                if b == b'\n' || st.line.len() >= MAX_LINE {
                    let line = String::from_utf8_lossy(&st.line).into_owned();
                    st.line.clear();
                    if st.kept.len() == KEPT_LINES {
                        st.kept.pop_front();
                    }
                    st.kept.push_back(line.clone());
                    done.push(line);
                }
                if b != b'\n' && b != b'\r' {
                    st.line.push(b);
                }
            }
        }
        if let Some(sink) = &self.sink {
            for line in &done {
                sink(line);
            }
        }
    }

    /// A guest read of one of the ports.
    pub fn read(&self, port: u16, data: &mut [u8]) {
        let value = if port == PORT_SERIAL + 5 {
            LSR_TX_EMPTY
        } else {
            0
        };
        data.fill(value);
    }

    /// The last lines the guest printed, oldest first.
    pub fn lines(&self) -> Vec<String> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.kept.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assembles_lines_and_bounds_them() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        let s = Serial::new(Some(Arc::new(move |l: &str| {
            g.lock().unwrap().push(l.to_string())
        })));
        for b in b"hello\r\nworld\n" {
            s.write(PORT_SERIAL, &[*b]);
        }
        s.write(PORT_SERIAL + 1, b"ignored\n");
        assert_eq!(*got.lock().unwrap(), vec!["hello", "world"]);
        s.write(PORT_SERIAL, &vec![b'x'; MAX_LINE * 2 + 1]);
        assert_eq!(s.lines().len(), 4);
        assert!(s.lines().iter().all(|l| l.len() <= MAX_LINE));
        let mut lsr = [0u8];
        s.read(PORT_SERIAL + 5, &mut lsr);
        assert_eq!(lsr[0], LSR_TX_EMPTY);
    }
}
