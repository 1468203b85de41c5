// The dedicated Web Worker that engine.js (createEngine, worker: true) runs the model in: its GPU device and
// buffers, the tokenizer and each generation step are here, off the page's main thread. Messages in and out are
// engine.js's Backend protocol.

import { Backend } from "./engine.js";

const backend = new Backend((message) => self.postMessage(message));
self.onmessage = (event) => void backend.receive(event.data);
